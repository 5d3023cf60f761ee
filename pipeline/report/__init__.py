"""The run report: content built section by section (content.py from accuracy.py, privacy.py and
curves.py), rendered to one offline HTML page and Markdown (render.py), with its figures (plots.py)."""
