//! What the examples share: their command lines (positional values, `--help`,
//! an error for anything else, exit status 2) and the median of timings.

use std::str::FromStr;

/// The positional values of an example's command line.
pub struct Args {
    usage: &'static str,
    values: Vec<String>,
}

impl Args {
    /// The command line of an example taking at most `names.len()`
    /// positional values: `--help` (or `-h`) prints `usage` and exits; any
    /// other flag, or one value too many, is an error that names it.
    pub fn parse(usage: &'static str, names: &[&str]) -> Self {
        use lexopt::prelude::*;
        let mut parser = lexopt::Parser::from_env();
        let mut values = Vec::new();
        loop {
            let arg = match parser.next() {
                Ok(Some(arg)) => arg,
                Ok(None) => break,
                Err(e) => fail(usage, e),
            };
            match arg {
                Short('h') | Long("help") => {
                    println!("{usage}");
                    std::process::exit(0);
                }
                Value(v) if values.len() < names.len() => match v.string() {
                    Ok(v) => values.push(v),
                    Err(e) => fail(usage, e),
                },
                arg => fail(usage, arg.unexpected()),
            }
        }
        Args { usage, values }
    }

    /// Positional value `i` (`name`), or `default` where the command line
    /// stops before it; a value that does not parse is an error naming it.
    pub fn get<T: FromStr>(&self, i: usize, name: &str, default: T) -> T {
        match self.values.get(i) {
            None => default,
            Some(v) => v.parse().unwrap_or_else(|_| {
                fail(self.usage, format!("<{name}>: {v:?} is not a valid value"))
            }),
        }
    }

    /// Positional value `i` as given, if there is one.
    #[allow(dead_code)] // not every example takes a word
    pub fn word(&self, i: usize) -> Option<&str> {
        self.values.get(i).map(String::as_str)
    }
}

/// Print `error` and `usage`, and exit with status 2 (a usage error).
pub fn fail(usage: &str, error: impl std::fmt::Display) -> ! {
    eprintln!("error: {error}\n{usage}");
    std::process::exit(2)
}

/// The median of `times` (the upper one of an even count).
///
/// # Panics
/// If `times` is empty.
#[allow(dead_code)] // not every example times
pub fn median<T: Copy + PartialOrd>(times: &[T]) -> T {
    let mut sorted = times.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).expect("timings are ordered"));
    sorted[sorted.len() / 2]
}
