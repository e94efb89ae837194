//! Warnings the user must see even in a program that installed no `log` logger.

/// Shows `message` as a warning: through `log` (level warn) when a logger is installed, else on
/// stderr. `log` drops every record until a logger raises its maximum level from `Off`, which is what an
/// application without a logger has; a program with a logger keeps control of where warnings go and may filter
/// them.
pub(crate) fn warn(message: std::fmt::Arguments<'_>) {
    if log::max_level() == log::LevelFilter::Off {
        eprintln!("umm: warning: {message}");
    } else {
        log::warn!("{message}");
    }
}
