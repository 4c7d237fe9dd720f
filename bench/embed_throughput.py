"""Kept so that old links work: ``run.py``'s news-documents profile with poolrunner,
sentence-transformers and plain transformers only. Takes ``run.py``'s options
(``--texts``, ``--dtypes``, ``--repeats``, ...); run ``python bench/run.py`` for everything."""

import sys

from run import main

if __name__ == "__main__":
    main(["--profiles", "docs", "--systems", "poolrunner,sentence-transformers,transformers", "--calls", "0",
          *sys.argv[1:]])
