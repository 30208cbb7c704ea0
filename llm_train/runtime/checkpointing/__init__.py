"""Checkpointing: how a run is saved and how it resumes, as one component (see resume.py)."""
