"""The `twinserve` command line: argument parsing over the library."""
