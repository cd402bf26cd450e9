"""Harbor / terminal-bench task directories as sandforge tasks: each task brings its own image, tests and solution."""
