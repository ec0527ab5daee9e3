//! What the run-manager reads from its own client certificate before using it:
//! the validity period and the subject's CommonName.
//!
//! The TLS library verifies certificates; it does not say, before a handshake,
//! that the client certificate this provider is about to present expired last
//! week (the coordinator then just closes the connection). So the two fields
//! X.509 fixes in place are read here with a minimal DER walk:
//!
//! ```text
//! Certificate  ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signature }
//! TBSCertificate ::= SEQUENCE { [0] version OPTIONAL, serialNumber INTEGER,
//!     signature SEQUENCE, issuer Name, validity SEQUENCE { notBefore Time,
//!     notAfter Time }, subject Name, ... }
//! Name ::= SEQUENCE OF SET OF SEQUENCE { type OID, value ANY }
//! Time ::= UTCTime (YYMMDDHHMMSSZ) | GeneralizedTime (YYYYMMDDHHMMSSZ)
//! ```
//!
//! Anything that does not have this shape yields `None` (never a panic), and
//! the caller leaves the judgement to the TLS library.

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const INTEGER: u8 = 0x02;
const OID: u8 = 0x06;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;
const EXPLICIT_0: u8 = 0xA0;
/// id-at-commonName, 2.5.4.3.
const OID_COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];

/// A point in time as a certificate states it: seconds since the Unix epoch
/// and the same instant written `YYYY-MM-DD HH:MM:SS UTC`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertTime {
    pub unix: i64,
    pub text: String,
}

/// The facts read from one certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFacts {
    /// The subject's CommonName (a provider's name under mutual TLS).
    pub common_name: Option<String>,
    pub not_before: CertTime,
    pub not_after: CertTime,
}

/// A cursor over DER tag-length-value items (short and long definite lengths).
struct Der<'a>(&'a [u8]);

impl<'a> Der<'a> {
    fn next(&mut self) -> Option<(u8, &'a [u8])> {
        let (&tag, rest) = self.0.split_first()?;
        let (&first, rest) = rest.split_first()?;
        let (len, rest) = if first < 0x80 {
            (usize::from(first), rest)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            let len = rest[..n]
                .iter()
                .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
            (len, &rest[n..])
        };
        if rest.len() < len {
            return None;
        }
        let (value, rest) = rest.split_at(len);
        self.0 = rest;
        Some((tag, value))
    }

    fn expect(&mut self, tag: u8) -> Option<&'a [u8]> {
        let (t, v) = self.next()?;
        (t == tag).then_some(v)
    }
}

/// Read the validity period and subject CN of a DER certificate.
pub fn facts(der: &[u8]) -> Option<CertFacts> {
    let cert = Der(der).expect(SEQUENCE)?;
    let mut tbs = Der(Der(cert).expect(SEQUENCE)?);
    let (mut tag, _) = tbs.next()?;
    if tag == EXPLICIT_0 {
        tag = tbs.next()?.0;
    }
    if tag != INTEGER {
        return None;
    }
    tbs.expect(SEQUENCE)?; // signature algorithm
    tbs.expect(SEQUENCE)?; // issuer
    let mut validity = Der(tbs.expect(SEQUENCE)?);
    let not_before = time(validity.next()?)?;
    let not_after = time(validity.next()?)?;
    let subject = tbs.expect(SEQUENCE)?;
    Some(CertFacts {
        common_name: common_name(subject),
        not_before,
        not_after,
    })
}

fn common_name(name: &[u8]) -> Option<String> {
    let mut rdns = Der(name);
    while let Some(set) = rdns.expect(SET) {
        let mut attributes = Der(set);
        while let Some(attribute) = attributes.expect(SEQUENCE) {
            let mut a = Der(attribute);
            let oid = a.expect(OID)?;
            let (_, value) = a.next()?;
            if oid == OID_COMMON_NAME {
                return String::from_utf8(value.to_vec()).ok();
            }
        }
    }
    None
}

/// A DER UTCTime or GeneralizedTime (always UTC, `Z`, whole seconds in DER).
fn time((tag, value): (u8, &[u8])) -> Option<CertTime> {
    let digits = value.strip_suffix(b"Z")?;
    if !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let num = |s: &[u8]| {
        s.iter()
            .fold(0i64, |acc, &b| acc * 10 + i64::from(b - b'0'))
    };
    let (year, rest) = match (tag, digits.len()) {
        (UTC_TIME, 12) => {
            // RFC 5280: YY >= 50 is 19YY, else 20YY.
            let yy = num(&digits[..2]);
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &digits[2..])
        }
        (GENERALIZED_TIME, 14) => (num(&digits[..4]), &digits[4..]),
        _ => return None,
    };
    let field = |i: usize| num(&rest[i..i + 2]);
    let (month, day, hour, minute, second) = (field(0), field(2), field(4), field(6), field(8));
    let valid = (1..=12).contains(&month)
        && (1..=31).contains(&day)
        && hour < 24
        && minute < 60
        && second < 61;
    if !valid {
        return None;
    }
    let unix = days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second;
    Some(CertTime {
        unix,
        text: format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02} UTC"),
    })
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DER tag-length-value, long-form lengths when needed.
    fn tlv(tag: u8, value: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        match value.len() {
            n if n < 0x80 => out.push(n as u8),
            n if n <= 0xff => out.extend([0x81, n as u8]),
            n => out.extend([0x82, (n >> 8) as u8, n as u8]),
        }
        out.extend_from_slice(value);
        out
    }

    fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
        parts.concat()
    }

    fn name(cn: &str) -> Vec<u8> {
        let org = tlv(
            SET,
            &tlv(
                SEQUENCE,
                &cat(&[tlv(OID, &[0x55, 4, 10]), tlv(0x0c, b"dflash")]),
            ),
        );
        let cn = tlv(
            SET,
            &tlv(
                SEQUENCE,
                &cat(&[tlv(OID, OID_COMMON_NAME), tlv(0x0c, cn.as_bytes())]),
            ),
        );
        tlv(SEQUENCE, &cat(&[org, cn]))
    }

    /// A certificate with the shape of X.509 v3 (the signature is not checked here).
    fn cert(not_before: (u8, &str), not_after: (u8, &str), cn: &str, version: bool) -> Vec<u8> {
        let alg = tlv(
            SEQUENCE,
            &tlv(OID, &[0x2a, 0x86, 0x48, 0xce, 0x3d, 4, 3, 2]),
        );
        let mut tbs = Vec::new();
        if version {
            tbs.push(tlv(EXPLICIT_0, &tlv(INTEGER, &[2])));
        }
        tbs.extend([
            tlv(INTEGER, &[0x01, 0x23, 0x45]),
            alg.clone(),
            name("issuer CA"),
            tlv(
                SEQUENCE,
                &cat(&[
                    tlv(not_before.0, not_before.1.as_bytes()),
                    tlv(not_after.0, not_after.1.as_bytes()),
                ]),
            ),
            name(cn),
            // A subjectPublicKeyInfo long enough to need a long-form length.
            tlv(SEQUENCE, &[0u8; 200]),
        ]);
        tlv(
            SEQUENCE,
            &cat(&[tlv(SEQUENCE, &tbs.concat()), alg, tlv(0x03, &[0; 65])]),
        )
    }

    #[test]
    fn reads_validity_and_common_name() {
        let der = cert(
            (UTC_TIME, "250102030405Z"),
            (GENERALIZED_TIME, "20510630235959Z"),
            "box-a",
            true,
        );
        let f = facts(&der).expect("facts");
        assert_eq!(f.common_name.as_deref(), Some("box-a"));
        // date -u -d '2025-01-02 03:04:05' +%s
        assert_eq!(f.not_before.unix, 1_735_787_045);
        assert_eq!(f.not_before.text, "2025-01-02 03:04:05 UTC");
        assert_eq!(f.not_after.unix, 2_571_782_399);
        assert_eq!(f.not_after.text, "2051-06-30 23:59:59 UTC");
        // Version 1 certificates have no [0] field; UTCTime years >= 50 are 19YY.
        let v1 = cert(
            (UTC_TIME, "991231235959Z"),
            (UTC_TIME, "491231235959Z"),
            "x",
            false,
        );
        let f = facts(&v1).expect("v1");
        assert_eq!(f.not_before.unix, 946_684_799);
        assert_eq!(f.not_after.text, "2049-12-31 23:59:59 UTC");
    }

    #[test]
    fn epoch_arithmetic() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
    }

    #[test]
    fn malformed_input_is_none_never_a_panic() {
        let good = cert(
            (UTC_TIME, "250102030405Z"),
            (UTC_TIME, "260102030405Z"),
            "box-a",
            true,
        );
        assert!(facts(&good).is_some());
        // Every truncation, and every single-byte corruption, either parses or is None.
        for n in 0..good.len() {
            assert_eq!(facts(&good[..n]), None, "truncated at {n}");
        }
        for i in 0..good.len() {
            for b in [0x00, 0x7f, 0x80, 0x84, 0xff] {
                let mut bad = good.clone();
                bad[i] = b;
                let _ = facts(&bad);
            }
        }
        for bad_time in [
            "2501020304Z",
            "25010203040aZ",
            "251302030405Z",
            "250102030405",
        ] {
            let der = cert((UTC_TIME, bad_time), (UTC_TIME, "260102030405Z"), "x", true);
            assert_eq!(facts(&der), None, "{bad_time}");
        }
        assert_eq!(facts(b""), None);
        assert_eq!(facts(b"-----BEGIN CERTIFICATE-----"), None);
    }
}
