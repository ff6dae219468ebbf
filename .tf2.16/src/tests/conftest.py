import os

# Quiet TF's C++ start-up chatter in test logs; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
