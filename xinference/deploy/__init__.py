"""Entry points: the command line, the in-process local cluster and the demo."""
