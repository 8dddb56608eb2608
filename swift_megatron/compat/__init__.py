"""Compatibility with other tools' APIs and file formats, kept at the edges (DESIGN.md section 5):
ms_swift/ lets plugin files written for ms-swift load unchanged. Only the loaders and the wiring
in rlhf/grpo/components.py use it; the trainer keeps one name per concept."""
