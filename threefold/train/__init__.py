"""The pieces of `threefold train`'s loop: optimizer groups, learning-rate schedule,
clipping, evaluation, metrics, end-of-run pictures and text generation. Each file has one
job; cli/train_cmd.py puts them together."""
