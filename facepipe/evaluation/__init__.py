"""Evaluation of a trained backbone: embeddings of pair images and face verification metrics."""
