"""Adapters that make TensorFlow and Chainer training state Stateful (numpy buffers, no pickle)."""
