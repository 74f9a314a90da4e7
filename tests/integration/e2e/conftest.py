import os
import sys

# The e2e tests share `metric_sinks`; under --import-mode=importlib a test's own directory is not
# on sys.path, so put it there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
