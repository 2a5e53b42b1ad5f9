//! What the benchmark programs of `src/bin` share: the CPU time they read off the machine, and
//! the median they report.

/// CPU time as the benchmark programs read it: from `/proc` (user + system, in clock ticks of
/// 1/100 s) and from Redis's own count.
pub mod measure {
    /// A process's name and user + system CPU ticks, from its `/proc/<pid>/stat` (or
    /// `/proc/self/stat`).
    #[must_use]
    pub fn process_ticks(path: &str) -> Option<(String, f64)> {
        let stat = std::fs::read_to_string(path).ok()?;
        let (head, tail) = stat.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_owned();
        // After the name: state is field 3 of the man page; utime and stime are fields 14 and 15.
        let fields: Vec<&str> = tail.split_whitespace().collect();
        let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
        Some((comm, ticks))
    }

    /// The CPU ticks so far of every process named `name` (its command name in `/proc`), summed.
    #[must_use]
    pub fn ticks_of_processes_named(name: &str) -> f64 {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| process_ticks(&entry.path().join("stat").to_string_lossy()))
            .filter(|(comm, _)| comm == name)
            .map(|(_, ticks)| ticks)
            .sum()
    }

    /// `used_cpu_user + used_cpu_sys` of Redis's `INFO cpu` (the main process), in microseconds.
    #[must_use]
    pub fn info_cpu_usec(info: &str) -> f64 {
        info.lines()
            .filter_map(|line| line.strip_prefix("used_cpu_user:").or_else(|| line.strip_prefix("used_cpu_sys:")))
            .filter_map(|seconds| seconds.trim().parse::<f64>().ok())
            .sum::<f64>()
            * 1e6
    }

    /// The median of the finite values (the mean of the middle two for an even count), or NaN
    /// if there is none.
    #[must_use]
    pub fn median(mut values: Vec<f64>) -> f64 {
        values.retain(|v| v.is_finite());
        if values.is_empty() {
            return f64::NAN;
        }
        values.sort_by(f64::total_cmp);
        let mid = values.len() / 2;
        if values.len() % 2 == 1 { values[mid] } else { f64::midpoint(values[mid - 1], values[mid]) }
    }
}
