"""The listener: it hears expired events, routes them, keeps loss control, shares the keys with its
fleet and repairs what Redis or a peer lost."""
