"""Monitoring: in-graph summary statistics, sinks (TensorBoard, DataFrames, plots), host
records, the training-loop tracker and the notebook display. Built on the drivers.
"""
