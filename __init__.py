"""Not the package: the root of a clone of the wna16_loader repository (the package is its folder wna16_loader/).

Python runs this file only when the clone itself is imported as `wna16_loader`: the clone's folder bears that
name and Python was started in the folder that holds it (its current folder comes first on sys.path). Without
this file Python would import the clone as an empty namespace package, which hides the installed package:
`cannot import name 'ParallelConfig' from 'wna16_loader' (unknown location)`. This says what happened instead.
"""

import os

_clone = os.path.dirname(os.path.abspath(__file__))
if __name__ == "wna16_loader":  # (a tool that imports the checkout's root under another name, e.g. pytest: nothing)
    raise ImportError(f"{_clone} is a clone of the wna16_loader repository, not the package (that is its folder "
                      f"{os.path.join(_clone, 'wna16_loader')}): Python imported it because it was started in "
                      f"{os.path.dirname(_clone)}, the folder holding the clone, and looks there first. Start Python in "
                      f"another folder (e.g. cd {_clone}), or rename the clone.")
