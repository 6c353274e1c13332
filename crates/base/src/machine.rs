//! What the machine has: memory available to this process now, disk free under a path.

/// Bytes free to an unprivileged writer on the filesystem holding `path` (or the nearest
/// existing directory above it).
pub fn disk_free(path: &std::path::Path) -> Option<u64> {
    let mut p = path;
    while !p.exists() {
        p = p.parent()?;
    }
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: a NUL-terminated path and a zeroed struct statvfs fills.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
}

/// Bytes the machine lets this process allocate now: the kernel's estimate of memory available
/// without swapping, bounded by the room left in the process's cgroup. `None` where neither can
/// be read.
pub fn machine_available() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| meminfo_available(&s));
    let cgroup = cgroup_room();
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
fn meminfo_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The limit of this process's cgroup less its usage (cgroup v2, then v1); `None` when
/// unlimited or unreadable.
fn cgroup_room() -> Option<usize> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let v2 = read("/proc/self/cgroup").and_then(|s| {
        let path = s
            .lines()
            .find_map(|l| l.strip_prefix("0::"))?
            .trim()
            .to_string();
        let dir = format!("/sys/fs/cgroup{path}");
        let max = read(&format!("{dir}/memory.max"))?;
        let current = read(&format!("{dir}/memory.current"))?;
        room(&max, &current)
    });
    v2.or_else(|| {
        room(
            &read("/sys/fs/cgroup/memory/memory.limit_in_bytes")?,
            &read("/sys/fs/cgroup/memory/memory.usage_in_bytes")?,
        )
    })
}

/// `limit - usage`, or `None` for "max" or a v1 limit so large it means none.
fn room(limit: &str, usage: &str) -> Option<usize> {
    let limit: u64 = limit.trim().parse().ok()?;
    let usage: u64 = usage.trim().parse().ok()?;
    if limit >= 1 << 60 {
        return None;
    }
    Some(limit.saturating_sub(usage) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_cgroup_values_are_read_as_bytes() {
        let m = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(meminfo_available(m), Some(2000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
        assert_eq!(room("1000\n", "400\n"), Some(600));
        assert_eq!(room("max\n", "400\n"), None);
        assert_eq!(room("9223372036854771712", "1"), None);
        assert_eq!(room("100", "400"), Some(0));
    }
}
