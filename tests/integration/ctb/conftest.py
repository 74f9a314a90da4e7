import os
import sys

# Both engines' tests share `ctb_contract`; under --import-mode=importlib a test's own directory
# is not on sys.path, so put it there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
