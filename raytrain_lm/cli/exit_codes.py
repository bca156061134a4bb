"""The statuses `raytrain-lm` exits with, besides 0 (done) and 1 (a submitted job failed)."""

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # stopped before the end (resumable), as after Ctrl-C
