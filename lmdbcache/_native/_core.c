/* lmdbcache._native._core: the compiled core of lmdbcache's read path (issue #24).
 *
 * Plain C11 against the CPython C API and the buffer protocol; no third-party source.
 * Everything read from a cache file is untrusted: every offset and length is checked
 * against the mapped length before the byte it names is read, and failures come back
 * as error codes that lmdbcache/_native turns into the library's exceptions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Bumped whenever the Python side's expectations of this module change. */
#define CORE_VERSION 1

static PyMethodDef core_methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmdbcache._native._core",
    .m_doc = "The compiled core of lmdbcache's read path (see lmdbcache/_native/__init__.py).",
    .m_size = -1,
    .m_methods = core_methods,
};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "VERSION", CORE_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
