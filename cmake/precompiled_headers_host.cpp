// [Precompiled headers] (cmake/SymbiosisPrecompiledHeaders.cmake): the translation unit whose
// targets compile the precompiled headers every other target reuses; the executable one needs main.
int main() { return 0; }
