"""C API (``liblazytriton.so``): reserved for the C API issue; nothing is implemented here yet."""
