//! The provider token: from `--token`, a token file, or the environment.
//!
//! Precedence: `--token` > `--token-file` / `DFLASH_PROVIDER_TOKEN_FILE` >
//! `DFLASH_PROVIDER_TOKEN`. A file is the way to keep the token off command
//! lines (which every user of the machine can read) and out of environments
//! that get copied around; so it must be this user's alone: a file readable or
//! writable by group or others is refused, like ssh refuses such a key.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::env_vars;
use crate::error::{Error, Result};

/// Longest token file read: tokens are tens of characters, so a larger file is the wrong file.
pub const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// Where the token came from (for the log; never the token itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    Flag,
    File(PathBuf),
    Env,
}

impl std::fmt::Display for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::Flag => f.write_str("`--token`"),
            TokenSource::File(p) => write!(f, "token file `{}`", p.display()),
            TokenSource::Env => write!(f, "`{}`", env_vars::PROVIDER_TOKEN),
        }
    }
}

/// The token by precedence: `flag`, else the token file `file`, else `env`
/// (the value of `DFLASH_PROVIDER_TOKEN`; blank counts as unset).
pub fn provider_token(
    flag: Option<&str>,
    file: Option<&Path>,
    env: Option<String>,
) -> Result<(String, TokenSource)> {
    if let Some(t) = flag {
        return Ok((t.trim().to_string(), TokenSource::Flag));
    }
    if let Some(p) = file {
        return Ok((read_token_file(p)?, TokenSource::File(p.to_path_buf())));
    }
    match env.map(|v| v.trim().to_string()) {
        Some(t) if !t.is_empty() => Ok((t, TokenSource::Env)),
        _ => Err(Error::Usage(format!(
            "no provider token given\nhint: pass `--token-file PATH` (mode 0600) or `--token`, or set `{}`; the coordinator's admin creates one with `dflash-coordinator providers create NAME`",
            env_vars::PROVIDER_TOKEN
        ))),
    }
}

/// Read a token file: mode 0600 or stricter, one line (surrounding
/// whitespace, a trailing newline included, is dropped), not empty.
pub fn read_token_file(path: &Path) -> Result<String> {
    let shown = path.display();
    let mut file = std::fs::File::open(path).map_err(|e| {
        Error::Usage(format!(
            "cannot read token file `{shown}`: {e}\nhint: check `--token-file` / `{}`",
            env_vars::PROVIDER_TOKEN_FILE
        ))
    })?;
    // The mode of the file that was opened, not of whatever the path names later.
    let meta = file
        .metadata()
        .map_err(|e| Error::Usage(format!("cannot stat token file `{shown}`: {e}")))?;
    if !meta.is_file() {
        return Err(Error::Usage(format!(
            "token file `{shown}` is not a regular file"
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(Error::Usage(format!(
            "token file `{shown}` has mode {mode:04o}: group or others can read or change it; it must be mode 0600 or stricter\nhint: chmod 600 {shown}"
        )));
    }
    let mut bytes = Vec::new();
    (&mut file)
        .take(MAX_TOKEN_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::Usage(format!("cannot read token file `{shown}`: {e}")))?;
    if bytes.len() as u64 > MAX_TOKEN_FILE_BYTES {
        return Err(Error::Usage(format!(
            "token file `{shown}` is larger than {MAX_TOKEN_FILE_BYTES} bytes: not a token"
        )));
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| Error::Usage(format!("token file `{shown}` is not UTF-8 text")))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(Error::Usage(format!(
            "token file `{shown}` is empty\nhint: write the token `dflash-coordinator providers create NAME` printed into it"
        )));
    }
    if token.contains(char::is_whitespace) {
        return Err(Error::Usage(format!(
            "token file `{shown}` holds more than one word or line; it must hold only the token"
        )));
    }
    Ok(token.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rm-token-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[test]
    fn trailing_newline_is_stripped() {
        let d = dir("newline");
        let p = d.join("token");
        write(&p, "tok_ABC-123\n", 0o600);
        assert_eq!(read_token_file(&p).expect("read"), "tok_ABC-123");
        write(&p, "  tok_ABC-123\r\n\n", 0o400);
        assert_eq!(read_token_file(&p).expect("read"), "tok_ABC-123");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn group_or_other_access_is_refused_with_the_chmod() {
        let d = dir("mode");
        let p = d.join("token");
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o666] {
            write(&p, "tok\n", mode);
            let err = read_token_file(&p).expect_err("mode");
            assert_eq!(err.exit_code(), 1);
            let want = format!(
                "token file `{}` has mode {mode:04o}: group or others can read or change it; it must be mode 0600 or stricter\nhint: chmod 600 {}",
                p.display(),
                p.display()
            );
            assert_eq!(err.to_string(), want);
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn missing_empty_and_odd_files() {
        let d = dir("odd");
        let missing = d.join("missing");
        let err = read_token_file(&missing).expect_err("missing");
        assert!(
            err.to_string().starts_with(&format!(
                "cannot read token file `{}`: No such file",
                missing.display()
            )),
            "{err}"
        );
        let empty = d.join("empty");
        write(&empty, " \n", 0o600);
        let err = read_token_file(&empty).expect_err("empty");
        assert!(err.to_string().contains("is empty\nhint:"), "{err}");
        let two = d.join("two");
        write(&two, "tok\nother\n", 0o600);
        assert!(read_token_file(&two)
            .expect_err("two")
            .to_string()
            .contains("more than one"));
        let big = d.join("big");
        write(&big, &"x".repeat(5000), 0o600);
        assert!(read_token_file(&big)
            .expect_err("big")
            .to_string()
            .contains("larger than"));
        let err = read_token_file(&d).expect_err("dir");
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn precedence_flag_then_file_then_env() {
        let d = dir("precedence");
        let p = d.join("token");
        write(&p, "from-file\n", 0o600);
        let env = || Some("from-env".to_string());
        assert_eq!(
            provider_token(Some("from-flag"), Some(&p), env()).expect("flag"),
            ("from-flag".into(), TokenSource::Flag)
        );
        assert_eq!(
            provider_token(None, Some(&p), env()).expect("file"),
            ("from-file".into(), TokenSource::File(p.clone()))
        );
        assert_eq!(
            provider_token(None, None, env()).expect("env"),
            ("from-env".into(), TokenSource::Env)
        );
        // A bad file is an error, not a silent fall back to the environment.
        write(&p, "from-file\n", 0o644);
        assert!(provider_token(None, Some(&p), env()).is_err());
        let err = provider_token(None, None, Some("  ".into())).expect_err("none");
        assert!(
            err.to_string().contains("hint: pass `--token-file PATH`"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
