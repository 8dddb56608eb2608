"""The demo: `megatron demo` runs the main job on an embedded tiny model and synthetic math
dataset (cli/demo.py); rewards.py is its reward plugin, loaded with --external_plugins like a
user's file."""
