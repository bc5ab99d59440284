"""The daemon's edges to its host: systemd (sd_notify, watchdog, socket activation), POSIX
signals and the config file watcher.

Each module is a thin edge: it turns the outside world into calls or values the supervisor
understands, decides nothing about policy, and never raises an I/O error into the daemon that
the daemon could not act on. `systemd` uses the standard library only, so the CLI may import it
without paying for anyio.
"""
