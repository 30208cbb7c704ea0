"""Tooling that builds environments beside the Makefile's: the GPU machine's wheels (`make gpu-wheels`)."""
