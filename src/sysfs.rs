//! Reading sysfs attributes (`/sys/class/...`), which hold one value per file.

/// The trimmed contents of `path`, or None where it cannot be read (absent in a container,
/// no such device).
pub(crate) fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}
