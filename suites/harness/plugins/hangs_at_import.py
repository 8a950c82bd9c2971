"""A plug-in that never finishes importing (a lock or a network wait at import): once it
made every command hang."""

import time

while True:
    time.sleep(1)
