//! CPU time of processes from `/proc/<pid>/stat` (Linux).

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

/// CPU time a process spent in user space and in the kernel, in seconds.
///
/// Kept apart because a proxy's two halves answer to different fixes: the
/// kernel's is the loopback TCP every proxy pays alike, the user half is
/// its own code.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct CpuTimes {
    pub(crate) user_s: f64,
    pub(crate) system_s: f64,
}

impl CpuTimes {
    pub(crate) fn total_s(self) -> f64 {
        self.user_s + self.system_s
    }

    /// What was spent from `earlier` to `self`.
    pub(crate) fn since(self, earlier: CpuTimes) -> CpuTimes {
        CpuTimes {
            user_s: self.user_s - earlier.user_s,
            system_s: self.system_s - earlier.system_s,
        }
    }
}

/// User and system CPU time of one process (all its threads).
pub(crate) fn cpu_times(pid: u32) -> Option<CpuTimes> {
    let fields = fields(pid)?;
    let ticks = |index: usize| -> Option<f64> {
        Some(fields.get(index)?.parse::<u64>().ok()? as f64 / TICKS_PER_S)
    };
    Some(CpuTimes {
        user_s: ticks(11)?,
        system_s: ticks(12)?,
    })
}

/// User and system CPU time of a process and its direct children (nginx's
/// master and its worker).
pub(crate) fn cpu_times_with_children(pid: u32) -> Option<CpuTimes> {
    let mut total = cpu_times(pid)?;
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
            let times = cpu_times(child).unwrap_or_default();
            total.user_s += times.user_s;
            total.system_s += times.system_s;
        }
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_time_is_readable() {
        let times = cpu_times(std::process::id()).expect("own /proc/<pid>/stat");
        assert!(times.user_s >= 0.0 && times.system_s >= 0.0);
        assert_eq!(times.since(times).total_s(), 0.0);
    }

    #[test]
    fn since_subtracts_each_half() {
        let earlier = CpuTimes {
            user_s: 1.0,
            system_s: 2.0,
        };
        let later = CpuTimes {
            user_s: 1.5,
            system_s: 4.0,
        };
        assert_eq!(
            later.since(earlier),
            CpuTimes {
                user_s: 0.5,
                system_s: 2.0
            }
        );
        assert_eq!(later.since(earlier).total_s(), 2.5);
    }
}
