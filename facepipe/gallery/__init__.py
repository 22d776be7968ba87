"""A gallery of face embeddings: search by cosine over identities (``search.py``) and the HTML page of
a search (``page.py``)."""
