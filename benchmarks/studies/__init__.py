"""One-off studies, frozen: each names the results file that holds what it found."""
