//! What the CUDA checks' external tools made (NVRTC's PTX, ptxas's report,
//! the host harness built by the C++ compiler), kept in the target
//! directory under a digest of everything that made it: the tool, its
//! options and its whole input. A test run after a build then redoes only
//! the compilations whose input changed; a cold run, or a changed kernel,
//! compiles as before. Only successes are kept, each written under a
//! private name and renamed into place, so concurrent tests never read a
//! partial file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The cache's directory (inside the target directory).
fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("boostr-tool-cache")
}

/// FNV-1a, 128 bits: a digest of `parts`, each length-prefixed so that
/// different splits of the same bytes differ.
fn digest(parts: &[&[u8]]) -> String {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut h: u128 = 0x6C62_272E_07BB_0142_62B8_2175_6295_C58D;
    for part in parts {
        for &b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h = (h ^ u128::from(b)).wrapping_mul(PRIME);
        }
    }
    format!("{h:032x}")
}

/// What identifies a tool: its path, size and modification time (a tool
/// replaced in place is a new tool).
pub fn tool_identity(tool: &Path) -> Vec<u8> {
    let meta = std::fs::metadata(tool).ok();
    let size = meta.as_ref().map_or(0, std::fs::Metadata::len);
    let modified = meta
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("{}\0{size}\0{modified}", tool.display()).into_bytes()
}

/// The file that `make` writes for `parts` (made once: later calls find
/// it). `make` gets the path to write.
pub fn file(
    kind: &str,
    parts: &[&[u8]],
    make: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<PathBuf, String> {
    static SERIAL: AtomicUsize = AtomicUsize::new(0);
    let dir = dir();
    let path = dir.join(format!("{kind}-{}", digest(parts)));
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
    let partial = dir.join(format!("{kind}-partial-{}-{serial}", std::process::id()));
    make(&partial)?;
    std::fs::rename(&partial, &path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// The text that `make` returns for `parts` (made once).
pub fn text(
    kind: &str,
    parts: &[&[u8]],
    make: impl FnOnce() -> Result<String, String>,
) -> Result<String, String> {
    let path = file(kind, parts, |to| {
        let text = make()?;
        std::fs::write(to, text).map_err(|e| format!("{}: {e}", to.display()))
    })?;
    std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
}

#[test]
fn a_digest_covers_every_part_and_a_result_is_made_once() {
    assert_ne!(digest(&[b"ab", b"c"]), digest(&[b"a", b"bc"]));
    assert_ne!(digest(&[b"abc"]), digest(&[b"abd"]));
    assert_eq!(digest(&[b"x", b""]), digest(&[b"x", b""]));
    let pid = std::process::id().to_le_bytes();
    let key: [&[u8]; 2] = [b"made once", &pid];
    let made = text("test", &key, || Ok("made".into()));
    assert_eq!(made.as_deref(), Ok("made"));
    let again = text("test", &key, || Err("made twice".into()));
    assert_eq!(again.as_deref(), Ok("made"));
    // A failure is not kept.
    let failed: [&[u8]; 2] = [b"fails", &pid];
    assert!(text("test", &failed, || Err("no".into())).is_err());
    assert_eq!(
        text("test", &failed, || Ok("now".into())).as_deref(),
        Ok("now")
    );
    for key in [key, failed] {
        let _ = std::fs::remove_file(dir().join(format!("test-{}", digest(&key))));
    }
}
