"""Tandem: distributed lossless speculative decoding."""
