"""A stand-in `sglang` package: only `python3 -m sglang.launch_server` (see launch_server.py)."""
