"""Weight quantization: RTN, GPTQ and AWQ, the GPTQ / AWQ checkpoint formats, weight-only kernels.

grid.py      QuantizedWeight (the one in-memory form) and the min-max grids
rtn.py, gptq.py, awq.py   the algorithms, as pure functions over tensors
calibration.py            calibration windows and block-by-block activation capture
formats.py   GPTQ / AWQ tensor layouts        kernels.py   int4 / int8 linear methods
pipeline.py  quantize a loaded model          save.py / loading.py   HF directories
"""
