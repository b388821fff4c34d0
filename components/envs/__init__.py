"""Real environments (TextWorld cooking, MiniWoB++) behind one text interface, and one episode played in them."""
