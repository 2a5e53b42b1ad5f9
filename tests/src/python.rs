//! Real clients written in Python (grpcio, Stripe's SDK), run by the tests from a virtual
//! environment of their own under `target/`, made once from `PyPI`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::services::absent;

/// The environments made (or failed) in this process, by name.
static MADE: Mutex<Vec<(String, Result<PathBuf, String>)>> = Mutex::new(Vec::new());

/// The Python interpreter of the virtual environment `target/<name>-venv` with `requirement`
/// (`package==version`) installed, made on first use; `ready` is a Python statement that fails
/// unless the right version is importable. `None`, loudly (a failure when services are
/// required), when it cannot be made.
///
/// # Panics
///
/// When the environment cannot be made and `IDEMPOTENT_REQUIRE_SERVICES=1` is set.
#[must_use]
pub fn venv(name: &str, requirement: &str, ready: &str) -> Option<PathBuf> {
    let mut made = MADE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let index = made.iter().position(|(made, _)| made == name).unwrap_or_else(|| {
        made.push((name.to_owned(), make(name, requirement, ready)));
        made.len() - 1
    });
    match &made[index].1 {
        Ok(python) => Some(python.clone()),
        Err(error) => {
            absent(&format!("{name} python tests: cannot install {requirement} from PyPI ({error})"));
            None
        }
    }
}

fn make(name: &str, requirement: &str, ready: &str) -> Result<PathBuf, String> {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../target/{name}-venv"));
    let python = venv.join("bin/python");
    let is_ready = || Command::new(&python).args(["-c", ready]).output().is_ok_and(|out| out.status.success());
    if is_ready() {
        return Ok(python);
    }
    run("python3".as_ref(), &["-m", "venv", venv.to_str().ok_or("a non-UTF-8 path")?])?;
    run(&venv.join("bin/pip"), &["install", "--quiet", requirement])?;
    if is_ready() { Ok(python) } else { Err(format!("installed, but `{ready}` fails")) }
}

fn run(program: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program).args(args).output().map_err(|e| format!("{}: {e}", program.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{} {args:?}: {}", program.display(), String::from_utf8_lossy(&out.stderr)))
    }
}
