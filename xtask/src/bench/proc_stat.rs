//! CPU time of processes from `/proc/<pid>/stat` (Linux).

use std::time::Duration;

/// Clock ticks per second of `/proc/<pid>/stat` times (USER_HZ): 100 on every
/// mainstream Linux.
const TICKS_PER_S: f64 = 100.0;

/// The fields after the command name (which is in parentheses and may hold
/// spaces): index 0 is the state, 1 the parent pid, 11 utime, 12 stime.
fn fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    Some(rest.split(' ').map(str::to_owned).collect())
}

/// User + system CPU time of one process (all its threads).
pub(crate) fn cpu_time(pid: u32) -> Option<Duration> {
    let fields = fields(pid)?;
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / TICKS_PER_S))
}

/// User + system CPU time of a process and its direct children (nginx's
/// master and its worker).
pub(crate) fn cpu_time_with_children(pid: u32) -> Option<Duration> {
    let mut total = cpu_time(pid)?;
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let parent = fields(child).and_then(|f| f.get(1).and_then(|p| p.parse::<u32>().ok()));
        if parent == Some(pid) {
            total += cpu_time(child).unwrap_or_default();
        }
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_time_is_readable() {
        assert!(cpu_time(std::process::id()).is_some());
    }
}
