"""What every runtime room stands on: collectives.py, launch_env.py, compat.py (runtime/__init__.py)."""
