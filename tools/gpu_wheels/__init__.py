"""The wheels the GPU machine lacks: built (build.sh), slimmed (slim_wheel.py) and proven complete (check.py)."""
