"""`pdserve bench soak`: a bounded mix of valid, malformed and abusive traffic against a local cluster,
then an audit of what it left behind (see run.py)."""
