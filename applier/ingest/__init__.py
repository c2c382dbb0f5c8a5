"""Ingest stage: received payloads -> the lane, a stream block's buffer, or the decoder.

``gate.IngestGate`` is the one place that decides, per payload, which way it goes.
"""
