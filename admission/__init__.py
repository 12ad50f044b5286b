"""Admission: which rows join the batch at which pass."""
