"""The command line's parts below its entry point (deepinfer/__main__.py, which may import all of them; none of
them imports it): requests.py reads the requests, checks.py checks a job's inputs before anything runs (the Preflight
callback calls it), job.py runs one offline job, outputs.py writes its outputs, summary.py its summary."""
