"""Using a trained model on photos: the model as a function of faces (``runtime``), how faces are cut
for it (``faces``), the embedding folder ``embed`` writes (``store``), search by cosine over
identities (``search``), the HTML page of a search (``page``) and its thumbnails (``thumbs``)."""
