"""Each op's float64 math, one file per op (``truth``), written without the op itself."""
