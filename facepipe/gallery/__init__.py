"""Using a trained model on photos: the model as a function of faces (``runtime``), how faces are cut
for it (``faces``), the embedding folder ``embed`` writes (``store``), gallery search (``search``)
and its HTML page (``page``)."""
