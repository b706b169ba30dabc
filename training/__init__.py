"""Offline training and evaluation of the generative retriever on a synthetic world."""
