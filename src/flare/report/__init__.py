"""Turning run directories into tables and figures."""
