//! Exponential backoff for worker restarts and coordinator retries.

use std::time::Duration;

/// `initial * factor^n`, capped at `max`. Deterministic; callers that want
/// jitter pass their own random fraction to [`Backoff::jittered`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub factor: u32,
}

impl Backoff {
    /// A doubling backoff from `initial` to `max`.
    pub fn doubling(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max: max.max(initial),
            factor: 2,
        }
    }

    /// Delay before retry number `n` (0-based). Never overflows, never exceeds `max`.
    pub fn delay(&self, n: u32) -> Duration {
        let mut d = self.initial;
        for _ in 0..n {
            d = match d.checked_mul(self.factor.max(1)) {
                Some(next) if next < self.max => next,
                _ => return self.max,
            };
        }
        d.min(self.max)
    }

    /// [`Backoff::delay`] shortened by up to `spread` (0..=1) of itself, using
    /// `u` in `[0, 1)`: spreads retries of many providers after an outage.
    pub fn jittered(&self, n: u32, spread: f64, u: f64) -> Duration {
        let base = self.delay(n);
        let cut = spread.clamp(0.0, 1.0) * u.clamp(0.0, 1.0);
        base.mul_f64(1.0 - cut)
    }
}

/// A cheap fraction in `[0, 1)` for jitter (not for anything security-related).
pub fn jitter_fraction() -> f64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    // xorshift of the nanoseconds and pid, so parallel processes differ.
    let mut x = u64::from(nanos) ^ (u64::from(std::process::id()) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_then_caps() {
        let b = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(1));
        let got: Vec<u128> = (0..6).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn huge_attempt_numbers_do_not_overflow() {
        let b = Backoff::doubling(Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(60));
        let b = Backoff {
            initial: Duration::from_secs(u64::MAX / 2),
            max: Duration::MAX,
            factor: 3,
        };
        assert_eq!(b.delay(5), Duration::MAX);
    }

    #[test]
    fn max_below_initial_is_raised_to_initial() {
        let b = Backoff::doubling(Duration::from_millis(500), Duration::from_millis(10));
        assert_eq!(b.delay(0), Duration::from_millis(500));
        assert_eq!(b.delay(3), Duration::from_millis(500));
    }

    #[test]
    fn jitter_only_shortens_and_stays_in_bounds() {
        let b = Backoff::doubling(Duration::from_millis(1000), Duration::from_secs(10));
        assert_eq!(b.jittered(0, 0.5, 0.0), Duration::from_millis(1000));
        assert_eq!(b.jittered(0, 0.5, 1.0), Duration::from_millis(500));
        assert_eq!(b.jittered(1, 2.0, 0.5), Duration::from_millis(1000)); // spread clamped to 1
        for _ in 0..100 {
            let u = jitter_fraction();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
    }
}
