"""The core every layer shares: feature schema, config, errors, run-folder layout.

It imports nothing of ours outside `recsys.core` (an import-linter contract checks it).
"""
