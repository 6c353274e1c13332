"""Resident memory of this process, for the benchmarks' Python peers (Linux /proc)."""


def proc_status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_reset():
    """Resident memory now, with the peak reset to it, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def rss_peak():
    """The resident peak since `rss_reset`, in bytes."""
    return proc_status("VmHWM")
