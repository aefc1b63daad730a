"""The error of reading a checkpoint, shared by its readers (Hugging Face checkpoint directories in
`prepare/checkpoint.py`, GGUF files in `prepare/gguf.py`), so that neither reader imports the other."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as given; the message names the file and the problem."""
