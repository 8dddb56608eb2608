"""The `megatron` command line: a router (main.py) and one thin module per command.

Installed as `swift_megatron.cli`. Modules here parse, validate and call the library; no logic.
"""
