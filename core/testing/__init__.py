"""Conformance kit for any backend: hypothesis strategies and shared checks."""
